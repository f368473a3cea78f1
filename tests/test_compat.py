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


def _retaining(kind):
    """A function that calls ``retain_grad()`` on a tensor it returns: alone, as a view of an
    intermediate, or beside another output computed from it (whose gradient reaches it too), and
    beside a view of it as well (which remat rebuilds outside the call)."""

    def fn(a, w):
        h = torch.tanh(a @ w)
        if kind == "view":
            h = h[1:].t()
        h.retain_grad()
        if kind == "sibling and view":
            return h, h.exp(), h[1:]
        return (h, h.exp()) if kind == "sibling" else h

    return fn


@pytest.mark.parametrize("kind", ["alone", "view", "sibling", "sibling and view"])
@pytest.mark.parametrize("how", ["backward", "twice", "loss_without_it"])
def test_retain_grad_on_a_returned_tensor_inside_the_function(kind, how):
    """The caller's output gets the ``.grad`` it gets without remat and under torch.utils.checkpoint,
    the part that reaches it through the call's other outputs included."""
    fn = _retaining(kind)

    def run(ckpt):
        w = W.clone().requires_grad_()
        outs = ckpt(fn, X, w)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if how == "loss_without_it" and kind.startswith("sibling"):
            loss = outs[1].sum()
        else:
            loss = sum((o * (k + 2)).square().sum() for k, o in enumerate(outs))
        loss.backward(retain_graph=how == "twice")
        if how == "twice":
            loss.backward()
        assert outs[0].retains_grad
        return outs[0].grad, w.grad

    expected = run(lambda fn, *a: fn(*a))
    assert expected[0] is not None
    assert_close(run(lambda fn, *a: upstream.checkpoint(fn, *a, use_reentrant=False)), expected)
    assert_close(run(funckpt.checkpoint), expected)
    assert_close(run(lambda fn, *a: funckpt.remat(fn)(*a)), expected)


@pytest.mark.parametrize("returned", [True, False])
def test_retain_grad_on_a_tensor_the_function_keeps_in_a_list(returned):
    """``h.retain_grad(); kept.append(h)`` (an activation kept for a saliency map): the tensor the
    forward pass kept gets its ``.grad`` after the backward pass, as without remat, also where the
    function returns it too. (The recomputation appends its own copy as well.)"""
    kept = []

    def fn(a, w):
        h = torch.tanh(a @ w)
        h.retain_grad()
        kept.append(h)
        return h if returned else h.exp() * 2

    def run(ckpt):
        kept.clear()
        w = W.clone().requires_grad_()
        out = ckpt(fn, X, w)
        out.square().sum().backward()
        return kept[0].grad, out.grad if returned else None, w.grad

    expected = run(lambda fn, *a: fn(*a))
    assert expected[0] is not None
    assert_close(run(lambda fn, *a: funckpt.remat(fn)(*a)), expected)
    assert_close(run(funckpt.checkpoint), expected)


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


@pytest.mark.parametrize("inner", ["remat", "scan", "scan-checkpoints"])
def test_torch_reentrant_checkpoint_in_a_region_nested_in_a_checkpointed_function(inner):
    """The reentrant checkpoint one level deeper: in a remat'd call or a loop's step inside a
    checkpointed function. The nested region meets the refusal under the enclosing region's
    torch.autograd.grad, which then falls back to a backward pass without inputs= as it does
    for a reentrant checkpoint of its own: a .backward() gives the plain function's gradients."""
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh())

    def step(h):
        return upstream.checkpoint(layer, torch.sin(h), use_reentrant=True)

    def fn(a, nested):
        if not nested:
            return step(step(a)).exp()
        if inner == "remat":
            return funckpt.remat(step)(funckpt.remat(step)(a)).exp()
        checkpoints = 1 if inner == "scan-checkpoints" else None
        return funckpt.scan(lambda h, _: (step(h), None), a, length=2, checkpoints=checkpoints)[0].exp()

    def run(nested):
        for p in layer.parameters():
            p.grad = None
        x = X.clone().requires_grad_()
        out = funckpt.checkpoint(fn, x, nested) if nested else fn(x, False)
        out.sum().backward()
        return out, x.grad, [p.grad for p in layer.parameters()]

    assert_close(run(True), run(False))
    with pytest.raises(funckpt.CheckpointError, match="use_reentrant=True"):
        torch.autograd.grad(funckpt.checkpoint(fn, X.clone().requires_grad_(), True).sum(), layer[0].weight)


@pytest.mark.parametrize("backward_inside", [False, True])
def test_saved_tensors_hooks_see_what_they_see_under_torch_checkpoint(backward_inside):
    """A user's ``saved_tensors_hooks`` (``save_on_cpu``, an activation offloader) pack the
    checkpointed call's inputs and what is outside it, never its internals: torch's
    checkpoint takes those with its own hooks, and packed, the forward run's would be copied
    away and never asked for again."""

    def g(x, w):
        return torch.sin(torch.mm(x, w)).exp().sum(0)

    def run(ckpt):
        packed, unpacked = [], []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.clone()

        def unpack(p):
            unpacked.append(tuple(p.shape))
            return p

        x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = ckpt(g, x, w, use_reentrant=False)
            loss = (out * out).sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
        empty = (0,)  # (torch 2.11's checkpoint saves an empty dummy tensor of its own)
        return sorted(s for s in packed if s != empty), sorted(s for s in unpacked if s != empty), x.grad, w.grad

    assert_close(run(funckpt.checkpoint), run(upstream.checkpoint))


def test_decorator_form_checkpoints_every_call_of_a_function_or_method():
    """``checkpoint(use_reentrant=False)`` without a function is a decorator (PyTorch >= 2.14)."""

    @funckpt.checkpoint(use_reentrant=False)
    def scaled(w, x, *, scale=1.0):
        return f(w, x, scale=scale)

    assert scaled.__name__ == "scaled"
    torch.manual_seed(0)
    got = tf.grad(lambda w: scaled(w, X, scale=2.0).sum())(W)
    torch.manual_seed(0)
    assert_close(got, tf.grad(lambda w: f(w, X, scale=2.0).sum())(W))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4, dtype=D)

        @funckpt.checkpoint(use_reentrant=False)
        def forward(self, x):
            return torch.tanh(self.linear(x))

    block = Block()
    params = {k: v.detach() for k, v in block.named_parameters()}
    got = tf.grad(lambda p: tf.functional_call(block, p, (X,)).square().sum())(params)
    linear = lambda p: torch.tanh(torch.nn.functional.linear(X, p["linear.weight"], p["linear.bias"]))  # noqa: E731
    expected = tf.grad(lambda p: linear(p).square().sum())(params)
    block(X).square().sum().backward()
    assert_close(got, expected)
    assert_close({k: p.grad for k, p in block.named_parameters()}, expected)
    with pytest.raises(ValueError, match="decorator"):
        funckpt.checkpoint(use_reentrant=False, scale=2.0)


@pytest.mark.parametrize("respect", [None, False, True])
def test_respect_saved_tensors_hooks_routes_the_kept_values_through_them(respect):
    """``respect_saved_tensors_hooks=True`` (PyTorch >= 2.14): what a selective ``context_fn``
    keeps is packed by the hooks the call is made under, and unpacked for the recomputation;
    otherwise it is kept as it is. Gradients are the same either way."""
    from functools import partial

    aten = torch.ops.aten
    context_fn = partial(upstream.create_selective_checkpoint_contexts, [aten.mm.default])
    x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
    kept = torch.mm(X, W)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.detach().clone())
        return ("box", t.detach().clone())

    def unpack(p):
        unpacked.append(p[1])
        return p[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = funckpt.checkpoint(
            lambda x, w: torch.sin(torch.mm(x, w)).sum(0),
            x,
            w,
            use_reentrant=False,
            context_fn=context_fn,
            respect_saved_tensors_hooks=respect,
        )
    out.square().sum().backward()
    x_ref, w_ref = X.clone().requires_grad_(), W.clone().requires_grad_()
    torch.sin(torch.mm(x_ref, w_ref)).sum(0).square().sum().backward()
    assert_close((x.grad, w.grad), (x_ref.grad, w_ref.grad))
    went_through = [any(torch.equal(t, kept) for t in seen) for seen in (packed, unpacked)]
    assert went_through == [respect is True] * 2
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks"):
        funckpt.checkpoint(torch.sin, X, respect_saved_tensors_hooks="yes")


def test_lossy_saved_tensors_hooks_raise_no_false_alarm_and_lossless_ones_keep_the_check():
    """Activation compression (hooks packing to bfloat16) hands the recomputation other inputs,
    by the caller's choice: it then computes other values, as torch's checkpoint does, without a
    determinism error. Hooks that give the inputs back as they were (``save_on_cpu``) keep the
    check: a function computing something else is still caught."""

    def g(w, x):
        return torch.tanh(x @ w) @ w.T

    def pack(t):
        return t.dtype, t.to(torch.bfloat16)

    def unpack(packed):
        return packed[1].to(packed[0])

    def grads(ckpt):
        w, x = W.float().requires_grad_(), X.float().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = ckpt(g, w, x, use_reentrant=False)
        return torch.autograd.grad(out.sum(), (w, x))

    assert_close(grads(funckpt.checkpoint), grads(upstream.checkpoint))

    calls = []

    def drifting(x):
        calls.append(1)
        return x.sin() if len(calls) % 2 else x.cos()

    x = X.clone().requires_grad_()
    with torch.autograd.graph.save_on_cpu():
        out = funckpt.checkpoint(drifting, x, use_reentrant=False)
    with pytest.raises(funckpt.CheckpointError, match="other values"):
        out.sum().backward()
