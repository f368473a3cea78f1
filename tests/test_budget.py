"""memory_budget(fraction): gradients unchanged, endpoints equal nothing/everything_saveable,
more budget never keeps fewer bytes nor recomputes more, and the choice favours expensive ops."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import funckpt
from funckpt import _budget, checkpoint_name, policies, remat
from tests.fakes import CountComputing

D = torch.float64
aten = torch.ops.aten
g = torch.Generator().manual_seed(41)
P = {
    "w1": torch.randn(8, 32, dtype=D, generator=g) / 3,
    "b1": torch.randn(32, dtype=D, generator=g),
    "w2": torch.randn(32, 8, dtype=D, generator=g) / 6,
}
X = torch.randn(5, 8, dtype=D, generator=g)


def mlp(p, x):
    h = F.layer_norm(x, x.shape[-1:])
    up = checkpoint_name(h @ p["w1"], "up")
    return x + F.gelu(up + p["b1"]).sin() @ p["w2"]


def loss(fn, depth=2):
    def f(p, x):
        for _ in range(depth):
            x = fn(p, x)
        return x.square().mean()

    return f


def kept(policy, p=P, x=X):
    """(source, shape, nbytes) of what the policy keeps, in trace order."""
    rs = funckpt.saved_residuals(remat(mlp, policy=policy), p, x)
    return [(r.source, r.shape, r.nbytes) for r in rs if r.kind == "saved by policy"]


def kept_bytes(policy):
    return sum(n for _, _, n in kept(policy))




def backward_ops(policy):
    """Operators executed by the backward pass (recomputation included) of one step."""
    p = {k: v.clone().requires_grad_() for k, v in P.items()}
    out = loss(remat(mlp, policy=policy))(p, X)
    with CountComputing() as c:
        out.backward()
    return c.n


def test_endpoints_equal_nothing_and_everything_saveable():
    assert kept(policies.memory_budget(0.0)) == kept(policies.nothing_saveable) == []
    assert kept(policies.memory_budget(1.0)) == kept(policies.everything_saveable)
    assert kept(policies.memory_budget(1)) == kept(policies.everything_saveable)
    assert backward_ops(policies.memory_budget(0.0)) == backward_ops(policies.nothing_saveable)
    assert backward_ops(policies.memory_budget(1.0)) == backward_ops(policies.everything_saveable)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_more_budget_never_keeps_fewer_bytes_nor_recomputes_more(a, b):
    lo, hi = sorted((a, b))
    small, large = kept(policies.memory_budget(lo)), kept(policies.memory_budget(hi))
    assert set(small) <= set(large)  # nested choices
    total = kept_bytes(policies.everything_saveable)
    assert sum(n for *_, n in small) <= sum(n for *_, n in large) <= total
    assert sum(n for *_, n in large) <= hi * total + 1e-6
    assert backward_ops(policies.memory_budget(lo)) >= backward_ops(policies.memory_budget(hi))


def test_the_budget_prefers_matmuls_per_byte():
    """A matmul costs 2k FLOPs per output element, an elementwise op about one: with room for
    the two matmuls' outputs, the budget keeps exactly those, not as many cheap values."""
    total = kept_bytes(policies.everything_saveable)
    down, up = 5 * 8 * 8, 5 * 32 * 8  # (5, 8) and (5, 32) float64 values
    assert kept(policies.memory_budget((down + up) / total)) == [
        ("aten.mm.default", (5, 32), up),
        ("aten.mm.default", (5, 8), down),
    ]
    # the down-projection (k=32) costs more per byte than the up-projection (k=8): it comes first
    assert kept(policies.memory_budget(down / total)) == [("aten.mm.default", (5, 8), down)]


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_values_and_gradients_unchanged_under_every_transform(fraction):
    policy = policies.memory_budget(fraction)
    f, r = loss(mlp), loss(remat(mlp, policy=policy))
    assert_close(r(P, X), f(P, X))
    assert_close(tf.grad(r)(P, X), tf.grad(f)(P, X))
    xs = torch.randn(3, 5, 8, dtype=D)
    assert_close(tf.vmap(tf.grad(r), in_dims=(None, 0))(P, xs), tf.vmap(tf.grad(f), in_dims=(None, 0))(P, xs))
    assert_close(tf.jacrev(r, argnums=1)(P, X), tf.jacrev(f, argnums=1)(P, X))
    small = X[:2]
    assert_close(tf.hessian(r, argnums=1)(P, small), tf.hessian(f, argnums=1)(P, small))
    p1 = {k: v.clone().requires_grad_() for k, v in P.items()}
    p2 = {k: v.clone().requires_grad_() for k, v in P.items()}
    r(p1, X).backward()
    f(p2, X).backward()
    assert_close({k: v.grad for k, v in p1.items()}, {k: v.grad for k, v in p2.items()})


def test_print_saved_residuals_shows_the_choice(capsys):
    funckpt.print_saved_residuals(remat(mlp, policy=policies.memory_budget(0.5)), P, X)
    out = capsys.readouterr().out
    assert "saved by policy" in out
    assert "mlp: memory_budget(0.5) kept" in out and "candidate values" in out and "the rest is recomputed" in out


def test_the_budget_is_per_call():
    """Two calls of different sizes: each keeps within its own fraction."""
    r = remat(mlp, policy=policies.memory_budget(0.4))
    big = torch.randn(50, 8, dtype=D)
    rs = funckpt.saved_residuals(lambda p, x, y: (r(p, x).sum(), r(p, y).sum()), P, X, big)
    total = {5: 0, 50: 0}
    for size in total:
        rs_all = funckpt.saved_residuals(remat(mlp, policy=policies.everything_saveable), P, torch.randn(size, 8, dtype=D))
        total[size] = sum(x.nbytes for x in rs_all if x.kind == "saved by policy")
    saved = [x for x in rs if x.kind == "saved by policy"]
    assert saved and sum(x.nbytes for x in saved) <= 0.4 * (total[5] + total[50])


def test_cost_estimates():
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    assert _budget.estimate_cost(aten.mm.default, (a, b), {}, a @ b) == 2 * 4 * 8 * 16
    assert _budget.estimate_cost(aten.gelu.default, (a,), {}, a) == 32
    q = torch.randn(2, 3, 8, 4)
    out = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
    assert _budget.estimate_cost(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {}, out) == 2 * 6 * 8 * 8 * 8
    x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    y = aten.convolution.default(*args)
    assert _budget.estimate_cost(aten.convolution.default, args, {}, y) == 2 * y.numel() * 3 * 3 * 3
    c = [_budget.Candidate(0, 8, 1.0), _budget.Candidate(1, 8, 100.0), _budget.Candidate(2, 0, 1.0)]
    assert _budget.choose(c, 0.0) == set() and _budget.choose(c, 1.0) == {0, 1, 2}
    assert _budget.choose(c, 0.5) == {1, 2}  # the free one and the expensive one
    assert _budget.choose(c, 0.49) == {2}  # a prefix: the expensive one does not fit, nothing after it is tried


def test_budget_under_torch_compile_runs_eagerly_and_is_correct():
    """A budget chooses among a whole call's values, which the compiler's per-operator policy
    cannot express: the call is not lowered to the compiler's checkpoint (a graph break)."""
    compiled = torch.compile(loss(remat(mlp, policy=policies.memory_budget(0.5))), backend="aot_eager")
    p1 = {k: v.clone().requires_grad_() for k, v in P.items()}
    p2 = {k: v.clone().requires_grad_() for k, v in P.items()}
    grads = torch.autograd.grad(compiled(p1, X), list(p1.values()))
    assert_close(grads, torch.autograd.grad(loss(mlp)(p2, X), list(p2.values())))


@pytest.mark.parametrize(
    "fraction, error, pattern",
    [
        (1.5, ValueError, r"fraction must be in \[0, 1\], got 1.5"),
        (-0.1, ValueError, "fraction"),
        (float("nan"), ValueError, "fraction"),
        ("0.5", TypeError, "fraction must be a number"),
        (None, TypeError, "fraction"),
        (True, TypeError, "fraction"),
        (torch.tensor(0.5), TypeError, "fraction"),
    ],
)
def test_bad_fraction_names_the_argument(fraction, error, pattern):
    with pytest.raises(error, match=pattern):
        policies.memory_budget(fraction)


def test_a_budget_is_not_combined_and_must_be_called():
    with pytest.raises(TypeError, match="policy_2 .* cannot be combined"):
        policies.save_from_both_policies(policies.dots_saveable, policies.memory_budget(0.5))
    with pytest.raises(TypeError, match=r"policy=policies.memory_budget\(...\)"):
        remat(mlp, policy=policies.memory_budget)


# ------------------------------------------------------------------ the benchmark stays runnable


def test_budget_benchmark_gpu_section_runs_in_its_small_configuration():
    from benchmarks import budget

    report = budget.gpu_section(small=True, rounds=1)
    for name in budget.all_policies():
        assert f"`{name}`" in report
    assert "dots' share" in report and "offloading dots: peak" in report


def test_budget_benchmark_dominance():
    from benchmarks import budget

    points = {name: (10.0, 1.0) for name in budget.all_policies()}
    points["dots_saveable"] = (5.0, 1.0)
    verdicts = budget.dominance(points)
    assert verdicts["dots_saveable"] is None and verdicts["nothing_saveable"] == "memory_budget(0)"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.floats(0.0, 1e9)), max_size=12),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_choose_is_nested_and_within_budget_for_any_candidates(values, a, b):
    candidates = [_budget.Candidate(i, n, c) for i, (n, c) in enumerate(values)]
    lo, hi = sorted((a, b))
    small, large = _budget.choose(candidates, lo), _budget.choose(candidates, hi)
    assert small <= large
    total = sum(c.nbytes for c in candidates)
    assert sum(c.nbytes for c in candidates if c.position in large) <= hi * total + 1e-6
    assert _budget.choose(candidates, 0.0) == set()
    assert _budget.choose(candidates, 1.0) == {c.position for c in candidates}
