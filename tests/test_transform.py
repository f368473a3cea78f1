"""remat's calling conventions, pytrees, static arguments and argument validation."""

from collections import namedtuple

import optree
import pytest
import torch
import torch.func as tf
from torch.testing import assert_close

import funckpt
from funckpt import remat

D = torch.float64
W = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(5))
X = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(6))


def f(w, x):
    """Docstring of f."""
    return torch.tanh(x @ w)


def test_bare_decorator_with_options_and_called_forms_are_equivalent():
    @remat
    def bare(w, x):
        return f(w, x)

    @remat(determinism_check="none")
    def with_options(w, x):
        return f(w, x)

    called = remat(f, debug=False)
    expected = tf.grad(lambda w: f(w, X).sum())(W)
    for g in (bare, with_options, called):
        assert_close(tf.grad(lambda w: g(w, X).sum())(W), expected)


def test_wraps_keeps_name_doc_and_wrapped():
    g = remat(f)
    assert g.__name__ == "f" and g.__doc__ == "Docstring of f." and g.__wrapped__ is f


Pair = namedtuple("Pair", ["a", "b"])


def test_pytree_arguments_and_outputs_with_non_tensor_leaves():
    def g(params, x, *, scale, tag=None):
        y = torch.tanh(x @ params["w"]) * scale
        return {"y": y, "aux": [params["b"].sum(), tag, 3], "pair": Pair(y.mean(), "name")}

    params = {"w": W, "b": torch.ones(4, dtype=D)}

    def loss(fn, params):
        out = fn(params, X, scale=2.0, tag="t")
        assert out["aux"][1] == "t" and out["aux"][2] == 3 and out["pair"].b == "name"
        return out["y"].sum() + out["aux"][0] + out["pair"].a

    assert_close(tf.grad(lambda p: loss(remat(g), p))(params), tf.grad(lambda p: loss(g, p))(params))


def test_custom_optree_node_registered_in_the_funckpt_namespace():
    class Box:
        def __init__(self, t, label):
            self.t, self.label = t, label

    optree.register_pytree_node(
        Box, lambda b: ((b.t,), b.label, None), lambda label, children: Box(children[0], label), namespace="funckpt"
    )
    try:

        def g(box, x):
            return Box(torch.tanh(x @ box.t), box.label + "!")

        out = remat(g)(Box(W, "w"), X)
        assert isinstance(out, Box) and out.label == "w!"
        got = tf.grad(lambda w: remat(g)(Box(w, "w"), X).t.sum())(W)
        assert_close(got, tf.grad(lambda w: g(Box(w, "w"), X).t.sum())(W))
    finally:
        optree.unregister_pytree_node(Box, namespace="funckpt")


class _TorchBox:
    """A container registered with torch's own pytree only (as transformers registers its ModelOutputs)."""

    def __init__(self, t, label):
        self.t, self.label = t, label


torch.utils._pytree.register_pytree_node(
    _TorchBox, lambda b: ([b.t], b.label), lambda children, label: _TorchBox(children[0], label)
)


def test_container_registered_with_torchs_pytree_only_flattens_as_there():
    def g(box, x):
        return _TorchBox(torch.tanh(x @ box.t), box.label + "!")

    out = remat(g)(_TorchBox(W, "w"), X)
    assert isinstance(out, _TorchBox) and out.label == "w!"
    assert_close(out.t, g(_TorchBox(W, "w"), X).t)
    got = tf.grad(lambda w: remat(g)(_TorchBox(w, "w"), X).t.sum())(W)
    assert_close(got, tf.grad(lambda w: g(_TorchBox(w, "w"), X).t.sum())(W))
    w = W.clone().requires_grad_()
    remat(g)(_TorchBox(w, "w"), X).t.square().sum().backward()
    w_ref = W.clone().requires_grad_()
    g(_TorchBox(w_ref, "w"), X).t.square().sum().backward()
    assert_close(w.grad, w_ref.grad)
    per_example = tf.vmap(lambda x: remat(g)(_TorchBox(W, "w"), x).t)(X.unsqueeze(1))
    assert_close(per_example, tf.vmap(lambda x: g(_TorchBox(W, "w"), x).t)(X.unsqueeze(1)))


def test_shapes_in_arguments_and_outputs_stay_torch_sizes():
    """A ``torch.Size`` is a leaf passed as it is, as without remat: not rebuilt as a plain tuple
    (torch's own pytree, which funckpt follows for the types registered there, rebuilds it as one),
    so ``size.numel()`` in the function and ``isinstance(out, torch.Size)`` for the caller work."""

    def g(x, size):
        return x.reshape(size) * size.numel(), x.shape, (x.size(), x.stride())

    for fn in (remat(g), remat(remat(g))):
        y, shape, (size, stride) = fn(X, torch.Size([X.numel()]))
        assert type(shape) is torch.Size and type(size) is torch.Size and shape.numel() == X.numel()
        assert type(stride) is tuple and stride == X.stride()
        assert_close(y, g(X, torch.Size([X.numel()]))[0])
    got = tf.grad(lambda x: remat(g)(x, torch.Size([X.numel()]))[0].square().sum())(X)
    assert_close(got, tf.grad(lambda x: g(x, torch.Size([X.numel()]))[0].square().sum())(X))


def test_static_argnums_pass_arguments_whole():
    seen = []

    def g(w, act, x, spec):
        seen.append((act, spec))
        return act(x @ w) * spec[0]

    h = remat(g, static_argnums=(1, -1))
    spec = [torch.tensor(2.0, dtype=D)]  # a static list holding a tensor is not flattened
    got = tf.grad(lambda w: h(w, torch.sin, X, spec).sum())(W)
    assert_close(got, tf.grad(lambda w: g(w, torch.sin, X, spec).sum())(W))
    assert all(a is torch.sin and s is spec for a, s in seen)


def test_kwargs_only_tensors():
    def g(*, w, x):
        return torch.tanh(x @ w)

    assert_close(
        tf.grad(lambda w: remat(g)(w=w, x=X).sum())(W),
        tf.grad(lambda w: g(w=w, x=X).sum())(W),
    )


def test_function_without_tensor_outputs_or_inputs():
    assert remat(lambda n: n + 1)(2) == 3
    assert remat(lambda: "x")() == "x"


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"policy": "dots"}, TypeError, "policy"),
        ({"static_argnums": "0"}, TypeError, "static_argnums"),
        ({"static_argnums": (0.5,)}, TypeError, "static_argnums"),
        ({"preserve_rng_state": 1}, TypeError, "preserve_rng_state"),
        ({"determinism_check": "strict"}, ValueError, "determinism_check"),
        ({"debug": "yes"}, TypeError, "debug"),
        ({"context_fn": 3}, TypeError, "context_fn"),
        ({"segments": 0}, ValueError, "segments"),
    ],
)
def test_bad_options_raise_at_decoration_naming_the_argument(kwargs, error, names):
    with pytest.raises(error, match=names):
        remat(f, **kwargs)
    with pytest.raises(error, match=names):
        remat(**kwargs)


def test_non_callable_fn_raises_naming_fn():
    with pytest.raises(TypeError, match="fn must be callable"):
        remat(42)


def test_static_argnums_out_of_range_raises_at_call_naming_it():
    g = remat(f, static_argnums=(2,))
    with pytest.raises(ValueError, match="static_argnums"):
        g(W, X)


def test_public_names():
    assert {"remat", "CheckpointError", "set_checkpoint_debug_enabled"} <= set(funckpt.__all__)
    assert issubclass(funckpt.CheckpointError, RuntimeError)


def test_context_fn_wraps_forward_and_recomputation_once_each():
    import contextlib

    events = []

    def context_fn():
        @contextlib.contextmanager
        def tag(name):
            events.append(f"enter {name}")
            yield
            events.append(f"exit {name}")

        return tag("forward"), tag("recompute")

    w = W.clone().requires_grad_()
    y = remat(f, context_fn=context_fn)(w, X)
    assert events == ["enter forward", "exit forward"]
    y.sum().backward()
    assert events == ["enter forward", "exit forward", "enter recompute", "exit recompute"]
    events.clear()
    tf.grad(lambda w: remat(f, context_fn=context_fn)(w, X).sum())(W)
    assert events == ["enter forward", "exit forward", "enter recompute", "exit recompute"]


def test_context_fn_must_return_two_contexts():
    with pytest.raises(TypeError, match="two context managers"):
        remat(f, context_fn=lambda: None)(W, X)


def test_segments_only_for_sequential():
    with pytest.raises(ValueError, match="segments"):
        remat(f, segments=2)


def test_objects_returned_next_to_the_outputs_may_hold_tensors_no_gradient_flows_through():
    """Logging statistics and constants in unregistered classes are fine under plain autograd."""

    class Stats:
        def __init__(self, mean):
            self.mean = mean

    def f(x):
        h = torch.tanh(x)
        prior = torch.distributions.Normal(torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype))
        return h, Stats(h.detach().mean()), prior, torch.arange(3)

    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    h, stats, prior, idx = remat(f)(x)
    torch.testing.assert_close(stats.mean, torch.tanh(x).mean().detach())
    torch.testing.assert_close(torch.autograd.grad(h.sum(), x), torch.autograd.grad(torch.tanh(x).sum(), x))


def test_a_dead_weak_proxy_next_to_the_outputs_is_passed_through():
    import weakref

    class Thing:
        pass

    def f(x):
        thing = Thing()
        return x.sin(), weakref.proxy(thing)  # dead once f returns

    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    y, _ = remat(f)(x)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x), (x.cos(),))


def test_a_dead_weak_proxy_inside_a_returned_object_is_skipped():
    import weakref

    class Thing:
        pass

    class Holder:
        def __init__(self, proxy):
            self.proxy = proxy

    def f(x):
        return x.sin(), Holder(weakref.proxy(Thing()))

    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    y, _ = remat(f)(x)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x), (x.cos(),))


def test_under_functionalize_a_remat_call_raises_what_to_do_and_functionalize_inside_remat_works():
    """torch has no functionalize rule for an autograd.Function with setup_context ("NYI:
    Functionalize rule for custom_function_call", raw, before): said at the call, with what to do.
    Functionalizing the function inside remat composes, under grad too."""
    w = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(x):
        y = x.clone()
        y.mul_(2).sin_()
        return y @ w

    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(funckpt.CheckpointError, match="functionalize"):
        tf.functionalize(remat(f))(x)
    with pytest.raises(funckpt.CheckpointError, match="functionalize"):
        tf.functionalize(tf.grad(lambda x: remat(f)(x).sum()))(x)
    assert_close(remat(tf.functionalize(f))(x), f(x))
    assert_close(
        tf.grad(lambda x: remat(tf.functionalize(f))(x).pow(2).sum())(x),
        tf.grad(lambda x: f(x).pow(2).sum())(x),
    )
