"""funckpt.checkpoint and checkpoint_sequential: PyTorch's arguments and results, also under torch.func."""

import contextlib

import pytest
import torch
import torch.func as tf
import torch.utils.checkpoint as upstream
from torch.testing import assert_close

import funckpt

D = torch.float64
W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(11))
X = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(12))


def f(w, x, *, scale=1.0):
    return torch.nn.functional.dropout(torch.tanh(x @ w), 0.3) * scale


def _grads(ckpt, use_reentrant):
    torch.manual_seed(0)
    w = W.clone().requires_grad_()
    out = ckpt(f, w, X, use_reentrant=use_reentrant)
    out.sum().backward()
    return out, w.grad


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_matches_torch_utils_checkpoint_under_backward(use_reentrant):
    assert_close(_grads(funckpt.checkpoint, use_reentrant), _grads(upstream.checkpoint, use_reentrant))


@pytest.mark.parametrize("use_reentrant", [None, True, False])
def test_checkpoint_works_under_torch_func_where_upstream_raises(use_reentrant):
    def loss(ckpt, **kwargs):
        return lambda w: ckpt(f, w, X, use_reentrant=use_reentrant, **kwargs).sum()

    with pytest.raises(RuntimeError), pytest.warns() if use_reentrant is None else contextlib.nullcontext():
        tf.grad(loss(upstream.checkpoint))(W)
    torch.manual_seed(0)
    got = tf.grad(loss(funckpt.checkpoint, scale=2.0))(W)
    torch.manual_seed(0)
    expected = tf.grad(lambda w: f(w, X, scale=2.0).sum())(W)
    assert_close(got, expected)


def test_checkpoint_passes_keyword_arguments_and_non_tensor_outputs():
    out = funckpt.checkpoint(lambda x, *, k: (x * k, "tag"), X, k=3)
    assert out[1] == "tag"
    assert_close(out[0], X * 3)


@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_takes_torchs_early_stop_and_does_not_pass_it_on(early_stop):
    """PyTorch's checkpoint has ``early_stop``: a caller passing it (HF's
    ``gradient_checkpointing_kwargs``) must not have it handed to the function."""

    def g(w, x, **kwargs):
        assert kwargs == {}
        return f(w, x)

    def run(ckpt):
        torch.manual_seed(0)
        w = W.clone().requires_grad_()
        ckpt(g, w, X, use_reentrant=False, early_stop=early_stop).sum().backward()
        return w.grad

    assert_close(run(funckpt.checkpoint), run(upstream.checkpoint))
    torch.manual_seed(0)
    got = tf.grad(lambda w: funckpt.checkpoint(g, w, X, use_reentrant=False, early_stop=early_stop).sum())(W)
    torch.manual_seed(0)
    assert_close(got, tf.grad(lambda w: f(w, X).sum())(W))
    with pytest.raises(TypeError, match="early_stop"):
        funckpt.checkpoint(g, W, X, early_stop="no")


def test_context_fn_contexts_each_entered_once_per_pass():
    entered = []

    def context_fn():
        @contextlib.contextmanager
        def mark(name):
            entered.append(name)
            yield

        return mark("forward"), mark("recompute")

    w = W.clone().requires_grad_()
    funckpt.checkpoint(f, w, X, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert entered == ["forward", "recompute"]
    funckpt.checkpoint(f, w, X, context_fn=upstream.noop_context_fn).sum().backward()


def test_bad_arguments():
    with pytest.raises(TypeError, match="function"):
        funckpt.checkpoint(3, X)
    with pytest.raises(TypeError, match="use_reentrant"):
        funckpt.checkpoint(f, W, X, use_reentrant="yes")
    with pytest.raises(ValueError, match="determinism_check"):
        funckpt.checkpoint(f, W, X, determinism_check="maybe")
    with pytest.raises(ValueError, match="segments"):
        funckpt.checkpoint_sequential(torch.nn.Sequential(torch.nn.Tanh()), 0, X)
    with pytest.raises(ValueError, match="unexpected keyword"):
        funckpt.checkpoint_sequential(torch.nn.Sequential(torch.nn.Tanh()), 1, X, bogus=1)


def _seq():
    torch.manual_seed(3)
    layers = []
    for _ in range(5):
        layers += [torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


@pytest.mark.parametrize("as_list", [False, True])
def test_checkpoint_sequential_matches_upstream(as_list):
    results = []
    for impl in (upstream.checkpoint_sequential, funckpt.checkpoint_sequential):
        net = _seq()
        functions = list(net) if as_list else net
        x = X.clone().requires_grad_()
        out = impl(functions, 3, x, use_reentrant=False)
        out.square().sum().backward()
        results.append((out, x.grad, [p.grad for p in net.parameters()]))
    assert_close(results[1], results[0])


def test_checkpoint_sequential_under_torch_func_grad_with_functional_call():
    net = _seq()
    params = dict(net.named_parameters())

    def loss(seq_fn):
        return lambda p: tf.functional_call(net, p, (X,), strict=True) if seq_fn is None else seq_fn(p)

    def via_checkpoint(p):
        with torch.nn.utils.stateless._reparametrize_module(net, p):
            return funckpt.checkpoint_sequential(net, 3, X, use_reentrant=False).square().sum()

    expected = tf.grad(lambda p: tf.functional_call(net, p, (X,)).square().sum())(params)
    assert_close(tf.grad(via_checkpoint)(params), expected)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_retain_grad_on_an_input_inside_the_function(use_reentrant):
    # Without remat (and with torch.utils.checkpoint) the caller's non-leaf input gets its .grad.
    def fn(a, w):
        a.retain_grad()
        return torch.tanh(a @ w)

    results = []
    for ckpt in (lambda fn, *a: fn(*a), upstream.checkpoint, funckpt.checkpoint):
        w = W.clone().requires_grad_()
        x = X.clone().requires_grad_()
        h = x * 2
        kw = {} if ckpt is not upstream.checkpoint and ckpt is not funckpt.checkpoint else {"use_reentrant": use_reentrant}
        ckpt(fn, h, w, **kw).square().sum().backward()
        assert h.grad is not None
        results.append((h.grad, x.grad, w.grad))
    assert_close(results[1], results[0])
    assert_close(results[2], results[0])


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_torch_reentrant_checkpoint_inside_the_function(use_reentrant):
    # torch.utils.checkpoint(use_reentrant=True) inside a checkpointed function: its backward
    # needs a backward pass without inputs=, as under torch.utils.checkpoint around it.
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Dropout(0.3), torch.nn.Tanh())
    head = torch.nn.Linear(4, 4, dtype=D)

    def fn(a):
        return head(upstream.checkpoint(layer, torch.sin(a), use_reentrant=True)).exp()

    results = []
    for ckpt in (lambda fn, *a, **k: fn(*a), upstream.checkpoint, funckpt.checkpoint):
        torch.manual_seed(0)
        for p in (*layer.parameters(), *head.parameters()):
            p.grad = None
        x = X.clone().requires_grad_()
        out = ckpt(fn, x, use_reentrant=use_reentrant)
        out.sum().backward()
        results.append((out, x.grad, [p.grad for p in (*layer.parameters(), *head.parameters())]))
    assert_close(results[1], results[0])
    assert_close(results[2], results[0])
    # torch.autograd.grad names its inputs: refused as without remat, by a CheckpointError saying why.
    with pytest.raises(funckpt.CheckpointError, match="use_reentrant=True"):
        torch.autograd.grad(funckpt.checkpoint(fn, X.clone().requires_grad_()).sum(), layer[0].weight)
