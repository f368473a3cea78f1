"""Saving policies: gradients unchanged, and what they keep is really not recomputed."""

import functools

import pytest
import torch
import torch.func as tf
import torch.utils.checkpoint as upstream
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import funckpt
from funckpt import CheckpointError, checkpoint_name, policies, remat

D = torch.float64
aten = torch.ops.aten
W1 = torch.randn(6, 12, dtype=D, generator=torch.Generator().manual_seed(21))
W2 = torch.randn(12, 6, dtype=D, generator=torch.Generator().manual_seed(22))
X = torch.randn(4, 6, dtype=D, generator=torch.Generator().manual_seed(23))


def block(w1, w2, x):
    h = checkpoint_name(torch.tanh(x @ w1), "hidden")
    return x + checkpoint_name(h.sin() @ w2, "out")


def loss(fn):
    return lambda w1, w2, x: fn(w1, w2, fn(w1, w2, x)).square().sum()


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))

    def count(self, *packets):
        return sum(op in packets for op in self.ops)


def grads_and_counts(fn, transform="grad"):
    with Count() as counter:
        if transform == "grad":
            g = tf.grad(loss(fn), argnums=(0, 1))(W1, W2, X)
        elif transform == "vmap_grad":
            g = tf.vmap(tf.grad(loss(fn), argnums=(0, 1)), in_dims=(None, None, 0))(W1, W2, X)
        elif transform == "vjp":
            out, vjp_fn = tf.vjp(lambda a, b: loss(fn)(a, b, X), W1, W2)
            g = vjp_fn(torch.ones_like(out))
        else:
            w1, w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
            loss(fn)(w1, w2, X).backward()
            g = (w1.grad, w2.grad)
    return g, counter


POLICIES = {
    "nothing_saveable": policies.nothing_saveable,
    "everything_saveable": policies.everything_saveable,
    "dots_saveable": policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": policies.save_only_these_names("hidden"),
    "save_any_names_but_these": policies.save_any_names_but_these("out"),
    "save_anything_except_these_names": policies.save_anything_except_these_names("hidden"),
    "save_from_both_policies": policies.save_from_both_policies(
        policies.dots_saveable, policies.save_only_these_names("hidden")
    ),
    "from_torch_fn": policies.from_torch(
        lambda ctx, op, *a, **k: upstream.CheckpointPolicy.MUST_SAVE
        if op == aten.mm.default
        else upstream.CheckpointPolicy.PREFER_RECOMPUTE
    ),
    "from_torch_list": policies.from_torch([aten.mm, aten.tanh.default]),
}


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap_grad", "backward"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_gradients_equal_unremat(name, transform):
    expected, _ = grads_and_counts(block, transform)
    got, _ = grads_and_counts(remat(block, policy=POLICIES[name]), transform)
    assert_close(got, expected)


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap_grad", "backward"])
def test_dots_saveable_recomputes_no_matmul(transform):
    _, plain = grads_and_counts(block, transform)
    _, nothing = grads_and_counts(remat(block), transform)
    _, dots = grads_and_counts(remat(block, policy=policies.dots_saveable), transform)
    mm = (aten.mm, aten.bmm, aten.addmm)
    assert nothing.count(*mm) == plain.count(*mm) + 4  # two blocks, two matmuls each, recomputed
    assert dots.count(*mm) == plain.count(*mm)  # none recomputed
    assert dots.count(aten.tanh) == nothing.count(aten.tanh)  # the elementwise work still is


@pytest.mark.parametrize("transform", ["grad", "vjp", "backward"])
@pytest.mark.parametrize("policy", ["dots_saveable", "save_only_these_names"])
def test_a_vector_times_a_matrix_is_kept_as_any_matmul(transform, policy):
    """``v @ w`` of a vector (an ODE's or an unbatched RNN's state) is ``mm`` then ``squeeze_``, an
    in-place view that reshapes the kept value: kept as ``mm`` returned it, no matmul runs again."""

    def vector_block(w1, w2, x):
        h = torch.tanh(checkpoint_name(x[0] @ w1, "up"))
        return x + checkpoint_name(h.sin() @ w2, "down")

    kept = policies.dots_saveable if policy == "dots_saveable" else policies.save_only_these_names("up", "down")
    plain_grads, plain = grads_and_counts(vector_block, transform)
    grads, counts = grads_and_counts(remat(vector_block, policy=kept), transform)
    assert_close(grads, plain_grads)
    mm = (aten.mm, aten.mv, aten.addmm)
    assert counts.count(*mm) == plain.count(*mm)  # none recomputed


@pytest.mark.parametrize("transform", ["grad", "vjp", "backward"])
@pytest.mark.parametrize("how", ["nn.Linear", "einsum"])
def test_a_name_on_a_view_of_a_matmul_keeps_the_matmul(transform, how):
    """``nn.Linear`` of a 3-D input (a transformer's ``(batch, tokens, width)``) is ``addmm`` of the
    input viewed to 2-D, its output viewed back to 3-D; ``einsum`` is a ``bmm``, permuted and viewed:
    what the function names is a view over all of the matmul's output. The names policy keeps that
    output (the same memory), so no matmul runs again; it used to keep nothing, silently."""
    lin = torch.nn.Linear(6, 12, dtype=D)
    with torch.no_grad():
        lin.weight.copy_(W1.t())

    def blocks(w1, w2, x):
        x3 = x.view(2, 2, 6)
        if how == "nn.Linear":
            up = torch.func.functional_call(lin, {"weight": w1.t(), "bias": lin.bias}, (x3,))
        else:
            up = torch.einsum("bti,ij->btj", x3, w1)
        h = torch.tanh(checkpoint_name(up, "up"))
        return x + checkpoint_name(torch.einsum("btj,ji->bti", h.sin(), w2), "down").reshape(4, 6)

    plain_grads, plain = grads_and_counts(blocks, transform)
    grads, counts = grads_and_counts(remat(blocks, policy=policies.save_only_these_names("up", "down")), transform)
    assert_close(grads, plain_grads)
    mm = (aten.mm, aten.bmm, aten.addmm)
    assert counts.count(*mm) == plain.count(*mm)  # none recomputed


@pytest.mark.parametrize("check", ["default", "none"])
def test_a_recomputation_writing_a_kept_value_in_place_leaves_it_for_the_next(check):
    """A recomputation may write a replayed value in place where the forward run did not (under
    torch.func transforms a linear's bias is added in place to the kept matmul): the write goes
    to that run's value only, and the next recomputation (a second backward, ``jacrev(jacrev)``)
    is handed the forward run's."""
    runs = []

    def f(x, w, b):
        y = x @ w
        runs.append(1)
        return torch.tanh(y + b if len(runs) == 1 else y.add_(b))  # the same values, in place after the first run

    w, b = W1.clone().requires_grad_(), torch.randn(12, dtype=D).requires_grad_()
    expected = torch.autograd.grad(torch.tanh(X @ w + b).sum(), (w, b))
    out = remat(f, policy=policies.dots_saveable, determinism_check=check)(X, w, b).sum()
    for _ in range(3):
        assert_close(torch.autograd.grad(out, (w, b), retain_graph=True), expected)


def test_everything_saveable_recomputes_nothing():
    _, plain = grads_and_counts(block, "backward")
    _, everything = grads_and_counts(remat(block, policy=policies.everything_saveable), "backward")
    assert everything.count(aten.mm, aten.tanh, aten.sin, aten.add) == plain.count(
        aten.mm, aten.tanh, aten.sin, aten.add
    )


def test_name_policies_keep_exactly_the_named_producers():
    _, nothing = grads_and_counts(remat(block), "grad")
    _, hidden = grads_and_counts(remat(block, policy=policies.save_only_these_names("hidden")), "grad")
    # the named tanh is kept (two calls: two fewer tanh), the matmuls are recomputed
    assert hidden.count(aten.tanh) == nothing.count(aten.tanh) - 2
    assert hidden.count(aten.mm) == nothing.count(aten.mm) - 0
    _, but = grads_and_counts(remat(block, policy=policies.save_any_names_but_these("hidden")), "grad")
    # "out" names the second matmul's result: kept; "hidden" is not
    assert but.count(aten.tanh) == nothing.count(aten.tanh)
    assert but.count(aten.mm) == nothing.count(aten.mm) - 2
    _, except_ = grads_and_counts(
        remat(block, policy=policies.save_anything_except_these_names("hidden")), "grad"
    )
    assert except_.count(aten.tanh) == nothing.count(aten.tanh)  # excluded: recomputed
    assert except_.count(aten.mm) == nothing.count(aten.mm) - 4  # everything else kept


def test_checkpoint_name_is_a_no_op_outside_remat_and_gradients_flow():
    x = X.clone().requires_grad_()
    y = checkpoint_name(x, "x")
    assert y is x
    assert_close(tf.grad(lambda x: checkpoint_name(x.sin(), "s").sum())(X), X.cos())
    with pytest.raises(TypeError, match="name"):
        checkpoint_name(x, 3)


def test_random_ops_are_never_kept_so_replay_stays_in_step():
    def noisy(w1, w2, x):
        h = torch.nn.functional.dropout(torch.tanh(x @ w1), 0.5)
        return h @ w2 + torch.rand_like(x)

    def run(fn):
        torch.manual_seed(5)
        return tf.grad(lambda w: fn(w, W2, X).sum())(W1)

    assert_close(run(remat(noisy, policy=policies.everything_saveable)), run(noisy))


def test_kept_value_modified_after_forward_is_computed_again():
    """A kept value modified in place after the forward run (through an alias the function
    leaked) no longer holds what its operator made: the recomputation runs the operator
    again, and the gradient is the forward pass's."""
    kept = {}

    def f(w1, x):
        y = x @ w1
        kept["y"] = y.detach()  # an alias of the kept value, leaked to the caller
        return y.sin()

    w1 = W1.clone().requires_grad_()
    out = remat(f, policy=policies.dots_saveable)(w1, X)
    kept["y"].mul_(2)
    out.sum().backward()
    assert_close(w1.grad, tf.grad(lambda w: f(w, X).sum())(W1))


@pytest.mark.parametrize("policy", [policies.dots_saveable, policies.everything_saveable])
def test_an_output_the_caller_updates_in_place_is_computed_again(policy):
    """A block ending in a matmul, its output updated in place by the caller (a residual
    ``h += x``, legal: nothing saved ``h``): the kept matmul output is stale, so it is not
    served; the gradient is the function's."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=D), torch.nn.GELU(), torch.nn.Linear(8, 4, dtype=D))

    def grads(block):
        x = X[:, :4].clone().requires_grad_()
        h = block(x)
        h += x
        h.square().sum().backward()
        return x.grad, [p.grad.clone() for p in mlp.parameters()]

    expected = grads(mlp)
    mlp.zero_grad(set_to_none=True)
    assert_close(grads(remat(mlp, policy=policy)), expected)


def test_a_kept_value_also_stored_outside_the_call_passes_its_gradient():
    """The policy keeps ``y`` for the recomputation; ``y`` itself, stored outside the call,
    becomes an output of the call, so a gradient through it reaches ``w1``."""
    kept = {}

    def f(w1, x):
        y = x @ w1
        kept["y"] = y
        return y.sin()

    def grads(fn):
        w1 = W1.clone().requires_grad_()
        out = fn(w1, X)
        return torch.autograd.grad(out.sum() + kept["y"].square().sum(), w1)

    assert_close(grads(remat(f, policy=policies.dots_saveable)), grads(f))


def test_kept_value_modified_inside_the_forward_is_recomputed():
    def f(w1, x):
        y = x @ w1
        y.mul_(2)
        return y.sin()

    w1 = W1.clone().requires_grad_()
    remat(f, policy=policies.dots_saveable)(w1, X).sum().backward()
    expected = tf.grad(lambda w: f(w, X).sum())(W1)
    assert_close(w1.grad, expected)


def _named_vector_matmul(w1, w2, x):
    v = x.reshape(-1, x.shape[-1])[0]  # (a vector, for a batch of rows or one row under vmap)
    return x + checkpoint_name(v @ w1, "up").tanh() @ w2


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap_grad", "backward"])
def test_a_named_matmul_of_a_vector_is_recomputed_not_replayed(transform):
    """``v @ w`` of a vector runs ``mm`` on ``v.unsqueeze(0)`` and then ``squeeze_`` on its result:
    the value the name finds is no longer what ``mm`` returned, so it is not handed back for it
    (the backward's matmul got the squeezed vector: torch's raw "mat2 must be a matrix")."""
    expected, _ = grads_and_counts(_named_vector_matmul, transform)
    got, _ = grads_and_counts(remat(_named_vector_matmul, policy=policies.save_only_these_names("up")), transform)
    assert_close(got, expected)


@pytest.mark.parametrize("check", ["default", "none"])
def test_a_named_value_written_in_place_after_its_operator_made_it_is_recomputed(check):
    def f(w1, x):
        y = x @ w1
        y.mul_(2)
        return checkpoint_name(y, "y").sin()

    w1 = W1.clone().requires_grad_()
    r = remat(f, policy=policies.save_only_these_names("y"), determinism_check=check)
    r(w1, X).sum().backward()
    assert_close(w1.grad, tf.grad(lambda w: f(w, X).sum())(W1))


def _attention_block(q, w, dropout_p=0.0):
    a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True)
    return (checkpoint_name(a, "attention") @ w).sin()


_ATTENTION_POLICIES = {
    "dots_saveable": policies.dots_saveable,
    "everything_saveable": policies.everything_saveable,
    "save_only_these_names": policies.save_only_these_names("attention"),
    "from_torch": policies.from_torch(
        [aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_attention_math]
    ),
}


def _attention_kernels(fn, how, dropout_p=0.0):
    """Gradients of ``fn`` (seeded) and how many attention forward kernels the step ran."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 6, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    w = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(4))
    with Count() as counter:
        if how == "backward":
            ql, wl = q.clone().requires_grad_(), w.clone().requires_grad_()
            fn(ql, wl, dropout_p).sum().backward()
            g = (ql.grad, wl.grad)
        else:
            g = tf.grad(lambda q, w: fn(q, w, dropout_p).sum(), argnums=(0, 1))(q, w)
    forward = [op for op in counter.ops if "scaled_dot_product" in str(op) and "backward" not in str(op)]
    return g, len(forward)


@pytest.mark.parametrize("how", ["backward", "grad"])
@pytest.mark.parametrize("policy", list(_ATTENTION_POLICIES))
def test_attention_without_dropout_is_kept_as_the_policy_asks(policy, how):
    """Every attention operator is tagged as random (for its dropout); called with ``dropout_p``
    0 it draws nothing, and a policy that asks for its result keeps it, as ``dots_saveable``
    promises: the recomputation does not run the attention again."""
    expected, once = _attention_kernels(_attention_block, how)
    got, kernels = _attention_kernels(remat(_attention_block, policy=_ATTENTION_POLICIES[policy]), how)
    assert_close(got, expected)
    assert kernels == once


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_attention_with_dropout_is_recomputed_with_the_same_mask(how):
    expected, once = _attention_kernels(_attention_block, how, dropout_p=0.5)
    got, kernels = _attention_kernels(remat(_attention_block, policy=policies.everything_saveable), how, dropout_p=0.5)
    assert_close(got, expected)
    assert kernels == 2 * once


def _std_mean_named_apart(x):
    s, m = torch.std_mean(x, dim=-1, keepdim=True)
    s = checkpoint_name(s, "spread")  # excluded: takes back what the operator-level answer kept
    m = checkpoint_name(m, "centre")  # another member, another name: keeps the operator's output again
    return ((x - m) / (s + 1.0)).sin()


@pytest.mark.parametrize(
    "policy",
    [
        policies.save_anything_except_these_names("spread"),
        policies.save_from_both_policies(
            policies.save_anything_except_these_names("spread"), policies.save_only_these_names("centre")
        ),
    ],
)
@pytest.mark.parametrize("transform", ["backward", "grad"])
def test_a_tuple_taken_back_by_an_excluded_name_is_kept_whole_by_another(policy, transform):
    """A name that the policy excludes took back std_mean's kept (std, mean); a name on the mean
    then kept the mean alone at that position, and the replay handed it back for the tuple
    (a false CheckpointError: "Object of type 'Tensor' is not an instance of 'sequence'")."""
    x = torch.randn(3, 5, dtype=torch.float64)
    if transform == "grad":
        got = tf.grad(lambda x: remat(_std_mean_named_apart, policy=policy)(x).sum())(x)
    else:
        xx = x.clone().requires_grad_()
        remat(_std_mean_named_apart, policy=policy)(xx).sum().backward()
        got = xx.grad
    assert_close(got, tf.grad(lambda x: _std_mean_named_apart(x).sum())(x))


def test_a_name_on_a_member_of_a_tuple_holding_nones_keeps_the_tuple():
    """convolution_backward returns (grad_input, None, None) where only the input's gradient is
    asked for: a name on grad_input kept it alone (the tuple holds no tensors only, so its
    members were not noted), and the replay handed a tensor back for the tuple."""
    w = torch.randn(2, 2, 3, dtype=torch.float64)

    def f(x):
        with torch.enable_grad():
            x0 = x if x.requires_grad else x.detach().requires_grad_()
            (g,) = torch.autograd.grad(torch.nn.functional.conv1d(x0, w).sin().sum(), x0, create_graph=True)
        return (checkpoint_name(g, "g") * x).sin()

    x = torch.randn(1, 2, 6, dtype=torch.float64)
    xx = x.clone().requires_grad_()
    remat(f, policy=policies.save_only_these_names("g"))(xx).sum().backward()
    xe = x.clone().requires_grad_()
    f(xe).sum().backward()
    assert_close(xx.grad, xe.grad)


def test_divergent_recomputation_falls_back_to_recomputing():
    def f(w1, x):
        if torch.is_grad_enabled():  # the forward runs without grad, the recomputation with it
            x = x * 1.0
        return (x @ w1).tanh()

    w1 = W1.clone().requires_grad_()
    remat(f, policy=policies.dots_saveable)(w1, X).sum().backward()
    assert_close(w1.grad, tf.grad(lambda w: f(w, X).sum())(W1))


def test_torch_selective_checkpoint_context_fn_is_understood():
    context_fn = functools.partial(upstream.create_selective_checkpoint_contexts, [aten.mm])

    def run(ckpt):
        with Count() as counter:
            g = tf.grad(lambda w: ckpt(block, w, W2, X).square().sum())(W1)
        return g, counter

    got, counts = run(lambda *a: funckpt.checkpoint(*a, use_reentrant=False, context_fn=context_fn))
    expected, plain = run(lambda f, *a: f(*a))
    assert_close(got, expected)
    assert counts.count(aten.mm) == plain.count(aten.mm)


def test_policy_errors_name_the_argument():
    with pytest.raises(TypeError, match="policy_2"):
        policies.save_from_both_policies(policies.dots_saveable, "x")
    with pytest.raises(TypeError, match="names must be strings"):
        policies.save_only_these_names(1)
    with pytest.raises(TypeError, match="from_torch"):
        policies.from_torch([1])


def test_kept_values_do_not_hold_the_forward_graph():
    """Keeping a matmul's output keeps that output, not the activations of the whole forward run."""
    from benchmarks._common import held_bytes

    w1 = torch.randn(64, 256, dtype=D, requires_grad=True)
    w2 = torch.randn(256, 64, dtype=D, requires_grad=True)
    x = torch.randn(128, 64, dtype=D)
    dots = held_bytes(lambda: remat(block, policy=policies.dots_saveable)(w1, w2, x))
    nothing = held_bytes(lambda: remat(block)(w1, w2, x))
    two_matmul_outputs = (128 * 256 + 128 * 64) * 8
    assert dots - nothing <= two_matmul_outputs + 1024, (dots, nothing)


def test_in_place_update_through_an_unsafe_view_of_a_kept_matmul_is_not_served():
    """4-D matmul returns an _unsafe_view of the bmm output (no shared version counter)."""

    def attention(q, k, v):
        scores = q @ k.transpose(-2, -1)
        scores.mul_(q.shape[-1] ** -0.5)
        return scores.softmax(-1) @ v

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=D, generator=g) for _ in range(3))
    for policy in (policies.dots_saveable, policies.everything_saveable):
        expected = tf.grad(lambda q: attention(q, k, v).square().sum())(q)
        got = tf.grad(lambda q: remat(attention, policy=policy)(q, k, v).square().sum())(q)
        assert_close(got, expected)


def test_names_are_matched_to_producers_by_identity_not_reused_ids():
    def f(x):
        out = x
        for i in range(50):
            t = out * 1.01  # freed at the next iteration: its id gets reused
            out = t + 0.01
            v = checkpoint_name(out[:], f"v{i}")  # a view: its producer is never recorded
            out = out * v.cos()
        return out

    x = torch.linspace(0, 1, 4, dtype=D)
    policy = policies.save_any_names_but_these()
    expected = tf.grad(lambda x: f(x).sum())(x)
    assert_close(tf.grad(lambda x: remat(f, policy=policy)(x).sum())(x), expected)


@pytest.mark.parametrize("f", [lambda x: -(-x), lambda x: x.cumsum(0).cumsum(0), lambda x: x.flip(0).flip(0)])
def test_forward_mode_recomputation_does_not_serve_kept_values_to_tangent_ops(f):
    x, t = torch.tensor([1.0, 2.0], dtype=D), torch.tensor([10.0, 20.0], dtype=D)
    expected = tf.jvp(f, (x,), (t,))
    assert_close(tf.jvp(remat(f, policy=policies.everything_saveable), (x,), (t,)), expected)
    assert_close(tf.jacfwd(remat(f, policy=policies.everything_saveable))(x), tf.jacfwd(f)(x))


def test_policy_results_must_be_bools_and_policy_errors_are_explained():
    with pytest.raises(CheckpointError, match="from_torch"):
        remat(block, policy=lambda op, *a, **k: upstream.CheckpointPolicy.PREFER_RECOMPUTE)(W1, W2, X)
    with pytest.raises(TypeError, match=r"call it, for example policy=policies.save_only_these_names\(...\)"):
        remat(block, policy=policies.save_only_these_names)  # caught at decoration, before any call
    my_factory = lambda *names: (lambda op, *a, **k: False)  # noqa: E731
    with pytest.raises(CheckpointError, match=r"returned <function .*a policy returns True \(keep\) or False"):
        remat(block, policy=my_factory)(W1, W2, X)


def test_policies_are_small_values_with_a_readable_repr():
    both = policies.save_from_both_policies(policies.dots_saveable, policies.from_torch([torch.ops.aten.mm]))
    assert repr(policies.dots_saveable) == "policies.dots_saveable"
    assert repr(policies.save_only_these_names("b", "a")) == "policies.save_only_these_names('a', 'b')"
    assert repr(both).startswith("policies.save_from_both_policies(policies.dots_saveable, policies.from_torch(")
    assert policies.save_only_these_names("a") == policies.save_only_these_names("a")  # values, not closures


def test_combinators_compose_what_names_mean():
    """Names matter to a combination if they matter to either part; exclusions hold where both exclude."""
    by_op = policies.save_from_both_policies(policies.dots_saveable, policies.from_torch([torch.ops.aten.mm]))
    by_name = policies.save_from_both_policies(policies.dots_saveable, policies.save_only_these_names("h"))
    assert not policies.uses_names(by_op) and policies.uses_names(by_name)
    a, b = policies.save_anything_except_these_names("x", "y"), policies.save_anything_except_these_names("y")
    assert policies.save_from_both_policies(a, b).excluded_names == frozenset({"y"})
    assert policies.uses_names(lambda op, *args, **kwargs: True)  # a plain function: assume names matter


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_everything_saveable_keeps_no_uninitialized_memory(randomness):
    """Factories of uninitialized memory are not kept: remat's own alias of an unused input,
    made by a nested call as ``empty(0).set_(...)``, was kept by the outer everything_saveable
    and served empty in its recomputation (a raw size error under ``grad(vmap)``)."""
    import torch.nn.functional as F

    W, b, xs = torch.randn(4, 4, dtype=D), torch.randn(4, dtype=D), torch.randn(2, 3, 4, dtype=D)

    def make(inner, outer):
        def f(x, W, b):
            inner(lambda x, W, b: x @ W)(x, W, b)  # (b unused, and the result too)
            return F.dropout(x, 0.3, training=True)

        return outer(f)

    def grads(f):
        torch.manual_seed(1)
        loss = lambda xs, W, b: tf.vmap(f, in_dims=(0, None, None), randomness=randomness)(xs, W, b).sin().sum()  # noqa: E731
        return tf.grad(loss, argnums=(0, 1, 2))(xs, W, b)

    expected = grads(make(lambda g: g, lambda g: g))
    assert_close(grads(make(remat, lambda g: remat(g, policy=policies.everything_saveable))), expected)
    kept = funckpt.saved_residuals(remat(lambda x: torch.empty_like(x).copy_(x).sin(), policy=policies.everything_saveable), X)
    assert not any("empty" in r.source for r in kept if r.kind == "saved by policy")


@pytest.mark.parametrize("write", ["foreach_add_", "unbind_copy_out"])
@pytest.mark.parametrize("route", ["backward", "torch.func.grad"])
def test_a_write_by_an_operator_returning_nothing_is_replayed(write, route):
    """An operator that writes its arguments and returns nothing (``torch._foreach_add_``,
    ``torch.unbind_copy(..., out=[...])``) is never kept: a recomputation handed its (empty)
    result would skip the write, and compute the rest from the values before it."""
    def f(x, m):
        h = x * 2
        y = (x + m).sin()
        if write == "foreach_add_":  # (an intermediate and a non-differentiable input)
            torch._foreach_add_([h, m], 1.0)
        else:  # (out= does not take a tensor requiring grad)
            torch.unbind_copy((m + 1).unsqueeze(0), out=[m])
        return h * h + y * m

    x = torch.tensor([0.1, 0.2, 0.3], dtype=D)
    m0 = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    for policy in (policies.everything_saveable, policies.dots_saveable):
        if route == "backward":
            grads = []
            for fn in (f, remat(f, policy=policy)):
                xr, m = x.clone().requires_grad_(), m0.clone()
                grads.append(torch.autograd.grad(fn(xr, m).sum(), xr)[0])
                assert_close(m, m0 + 1)
            assert_close(grads[1], grads[0])
        else:
            g = lambda fn: tf.grad(lambda x: fn(x, m0.clone()).sum())(x)  # noqa: E731
            assert_close(g(remat(f, policy=policy)), g(f))


@pytest.mark.parametrize("route", ["backward", "torch.func.grad"])
def test_an_operator_writing_an_intermediate_and_returning_new_values_is_run_again(route):
    """Batch norm in training mode returns new values and writes the running statistics it is
    handed; where those are an intermediate the function reads again, the recomputation must run
    it too (handed what it returned, it would read the statistics from before the write)."""

    def f(x):
        h = x * 2
        running_mean, running_var = (x * 3).detach().mean(0), torch.ones(4, dtype=D)
        y = torch.nn.functional.batch_norm(h, running_mean, running_var, training=True, momentum=0.5)
        return ((y + h) * running_mean).sum()

    x = torch.randn(8, 4, dtype=D, generator=torch.Generator().manual_seed(0))
    for policy in (policies.everything_saveable, policies.dots_saveable):
        if route == "backward":
            xr = x.clone().requires_grad_()
            expected = torch.autograd.grad(f(xr), xr)
            assert_close(torch.autograd.grad(remat(f, policy=policy)(xr), xr), expected)
        else:
            assert_close(tf.grad(remat(f, policy=policy))(x), tf.grad(f)(x))


@pytest.mark.parametrize("check", ["default", "none"])
@pytest.mark.parametrize("policy", [policies.dots_saveable, policies.everything_saveable])
def test_a_tail_result_computed_off_course_is_not_handed_a_kept_value(policy, check, monkeypatch):
    """The recomputation makes one call the forward run did not (``.contiguous()`` of a contiguous
    tensor: no operator), so the tail's deferral starts a call early and the last matmul's operand
    is computed then; the replayer counted that matmul as the forward run's next operator (the last
    matmul, of the same shapes) and handed back its kept output: ``a`` held ``a @ w2``. A wrong
    ``w2.grad`` with ``determinism_check='none'``, a false CheckpointError with the check."""
    from funckpt import _tail

    monkeypatch.setitem(_tail._WORTH, "cpu", 0)
    g = torch.Generator().manual_seed(0)
    w1, w2, x = (torch.randn(4, 4, dtype=torch.float64, generator=g) for _ in range(3))
    calls = []

    def f(x, w2):
        calls.append(None)
        h = x.sin()
        if len(calls) > 1:
            h = h.contiguous()
        return (h @ w1) @ w2

    got = [t.clone().requires_grad_() for t in (x, w2)]
    remat(f, policy=policy, determinism_check=check)(*got).tanh().sum().backward()
    expected = [t.clone().requires_grad_() for t in (x, w2)]
    f(*expected).tanh().sum().backward()
    assert_close([t.grad for t in got], [t.grad for t in expected])


@pytest.mark.parametrize("transform", ["backward", "grad"])
@pytest.mark.parametrize("error", [torch.OutOfMemoryError, ValueError], ids=["out of memory", "another error"])
def test_a_policy_that_raises_out_of_memory_raises_out_of_memory(error, transform):
    """An out-of-memory error raised while the policy decides (a policy inspecting its operator's
    tensors allocates) reaches the caller as torch.OutOfMemoryError, as one raised anywhere else in the
    call does (a training loop that skips the batch catches it); any other error of the policy is a
    CheckpointError that names the policy, chained to it."""

    def policy(op, *args, **kwargs):
        if op is torch.ops.aten.tanh.default:
            raise error("raised by the policy")
        return False

    g = remat(lambda w, x: torch.tanh(x @ w) @ w.T, policy=policy)
    w = torch.randn(6, 6, dtype=D)
    with pytest.raises(error if error is torch.OutOfMemoryError else CheckpointError) as info:
        if transform == "backward":
            g(w.clone().requires_grad_(), X).sum().backward()
        else:
            tf.grad(lambda w: g(w, X).sum())(w)
    if error is not torch.OutOfMemoryError:
        assert "the saving policy" in str(info.value) and type(info.value.__cause__) is error
